"""The pipeline's stages: one thin module each, reading params and files, calling the
library, writing outputs and provenance. DVC runs them as ``quanthunt <stage>``."""
