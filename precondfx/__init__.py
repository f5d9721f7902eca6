from precondfx.errors import PrecondError

__all__ = ["PrecondError"]
