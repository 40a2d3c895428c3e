"""`tandem-driver demo`: the simulation (`sim`) and the real daemon composed into one story.

The only package that knows both sides: `driver` never imports `sim`, and `sim` never imports
`driver` (import-linter holds both); `driver.cli` reaches in here for the `demo` subcommand alone.
"""
