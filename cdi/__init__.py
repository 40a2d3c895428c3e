"""Container Device Interface (CDI) specs: model, validation, atomic writes. Imports nothing of `driver`."""
