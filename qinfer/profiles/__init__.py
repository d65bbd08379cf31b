"""Data: device profiles (devices/*.json) and supported models (models/*.json)."""
