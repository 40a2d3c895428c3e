"""tests/unit mirrors driver/'s packages. This conftest puts tests/unit itself on sys.path (pytest
does so for a non-package directory holding a conftest), so tests in any subfolder import the
shared fakes beside it (`prepare_fakes`, `mig_fakes`, `scheduler_fakes`) by name."""
