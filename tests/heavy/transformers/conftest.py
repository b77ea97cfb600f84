"""The transformers suite (runs under the heavy `transformers` environment)."""
