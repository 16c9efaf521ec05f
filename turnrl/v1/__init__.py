"""Stubs generated from protos/turnrl/v1/ by `make protos`. Never edit them by hand."""
