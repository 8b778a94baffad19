from tunix_pipeline.errors import UserError


class ModelError(UserError, ValueError):
    """A model folder, id or setting that cannot be used; the message says how to fix it."""
