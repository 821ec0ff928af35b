"""gpudet's public name for its Python API, `import gpudet`: everything `pipeline` exports.

    import gpudet
    detector = gpudet.Detector.from_config(device="cuda")
    for result in detector.run("photos/"):
        ...

The import package is `pipeline` (the project's layout); installed, this package is `gpudet`.
"""

import pipeline
from pipeline import __all__, __version__  # noqa: F401


def __getattr__(name: str):
    return getattr(pipeline, name)


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
