"""Which storage options are secrets, and how a store saved without them gets them back.

A store is pickled twice over in a job's life: to ship it to the training processes (they need its credentials, so
that pickle keeps every option), and inside a saved Spark ML stage (an estimator written with ``save``), which lands
in files anyone with read access to the path can open. For the second, :meth:`Store.without_secrets
<spark_hvd.store.base.Store.without_secrets>` keeps the URL and the non-secret options only: every option whose
name looks like a secret (:data:`SECRET_NAME`, also inside nested dicts such as ``client_kwargs``) and every value
that is not plain data (a session or credentials object) is dropped.

At load time the secrets come back from, in order of precedence:

1. the caller: ``est.setStore(est.getStore().with_options(key=..., secret=...))``;
2. the environment: ``SPARK_HVD_STORAGE_OPTIONS``, a JSON object of storage options merged into every store that
   was saved without its secrets;
3. the filesystem's own credential chain (for S3: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws``,
   an instance role), which applies whenever ``key``/``secret`` are absent.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import TYPE_CHECKING, Any

from spark_hvd.store.errors import StoreURLError

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.store.base import Store

logger = logging.getLogger(__name__)

#: Storage option names treated as secrets (case-insensitive search).
SECRET_NAME = re.compile(r"key|secret|token|passw|credential|sas|signature|auth|session|connection_string|private",
                         re.IGNORECASE)
#: Environment variable with storage options (a JSON object) for stores loaded without their secrets.
STORAGE_OPTIONS_ENV = "SPARK_HVD_STORAGE_OPTIONS"


def split_secrets(options: dict[str, Any], _prefix: str = "") -> tuple[dict[str, Any], list[str]]:
    """``(options without secrets, dotted names of what was dropped)``."""
    public: dict[str, Any] = {}
    dropped: list[str] = []
    for name, value in options.items():
        dotted = f"{_prefix}{name}"
        if SECRET_NAME.search(str(name)):
            dropped.append(dotted)
        elif isinstance(value, dict):
            inner, inner_dropped = split_secrets(value, f"{dotted}.")
            public[name] = inner
            dropped.extend(inner_dropped)
        elif _plain(value):
            public[name] = value
        else:
            dropped.append(dotted)  # an object (a session, credentials): may hold secrets, and may not pickle
    return public, dropped


def options_from_env() -> dict[str, Any]:
    """The storage options in ``SPARK_HVD_STORAGE_OPTIONS`` (``{}`` when unset).

    Raises:
        StoreURLError: the variable is not a JSON object.
    """
    raw = os.environ.get(STORAGE_OPTIONS_ENV, "").strip()
    if not raw:
        return {}
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as e:
        raise StoreURLError(f"{STORAGE_OPTIONS_ENV} is not valid JSON: {e.msg} at character {e.pos}") from e
    if not isinstance(options, dict):
        raise StoreURLError(f"{STORAGE_OPTIONS_ENV} must be a JSON object of storage options, got {type(options)}")
    return options


def merge_options(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``extra``, nested dicts merged key by key."""
    out = dict(base)
    for name, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(name), dict):
            out[name] = merge_options(out[name], value)
        else:
            out[name] = value
    return out


def restore_without_secrets(cls: type[Store], url: str, public: dict[str, Any], dropped: list[str],
                            layout: dict[str, str] | None = None) -> Store:
    """Unpickle what :meth:`Store.without_secrets` pickled: the options in ``SPARK_HVD_STORAGE_OPTIONS`` are merged
    in; options that were dropped and not given back are named in a log line."""
    env = options_from_env()
    missing = [name for name in dropped if not _has_dotted(env, name)]
    if missing:
        logger.info("the store %s was saved without its options %s; give them back with "
                    "store.with_options(...) or %s, else the filesystem's own credentials apply",
                    url, missing, STORAGE_OPTIONS_ENV)
    return cls(url, **merge_options(public, env), **(layout or {}))


def _has_dotted(options: dict[str, Any], dotted: str) -> bool:
    head, _, rest = dotted.partition(".")
    if head not in options:
        return False
    return not rest or (isinstance(options[head], dict) and _has_dotted(options[head], rest))


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return False
