"""Architecture tables (``*.toml``), one per model family; read by ``kimi_convert.mapping``."""
