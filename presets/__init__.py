"""Preset spec files (``*.toml``), one per model family; read by ``kimi_convert.synth`` (docs/presets.md)."""
