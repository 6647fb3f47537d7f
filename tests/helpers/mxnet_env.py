"""Whether MXNet imports here (MXNet 1.9.1 needs Python 3.11 and numpy < 1.24: the floor runtime's environment,
not the main lock's), and the reason to skip when it does not."""

from __future__ import annotations


def mxnet_skip_reason() -> str | None:
    """None when ``import mxnet`` works, else why not (MXNet 1.9 raises AttributeError, not ImportError, on numpy
    >= 1.24: it reads ``np.bool``)."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import mxnet
    except Exception as e:  # noqa: BLE001 - any failure to import is a reason to skip
        return f"mxnet does not import here ({type(e).__name__}: {e}); see docs/mxnet.md for its environment"
    if getattr(mxnet, "__file__", None) is None:  # a directory named mxnet on sys.path, not the package
        return f"mxnet is not installed here (import mxnet found {list(mxnet.__path__)}); see docs/mxnet.md"
    return None
