"""eyas: raise EAGLE-3 draft models for SGLang-served targets."""

__version__ = "0.1.0"
