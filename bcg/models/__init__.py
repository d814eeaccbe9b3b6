"""Model architectures, their shared interface, the architecture registry and presets."""
