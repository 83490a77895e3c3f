"""One module per top-level config section; each defines the pydantic models for it."""
