"""Integrations with training frameworks: transformers (``hf``) and Lightning (``lightning``).

Neither framework is imported by ``import precondfx``; each module imports its framework
lazily and says what to install when it is missing."""
