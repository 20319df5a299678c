"""The implementation of cannjax. Nothing here is public: every public name is re-exported
once by one module of :mod:`cannjax` (``docs/architecture.md`` maps the layers)."""
