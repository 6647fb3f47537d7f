"""Installs the ``horovod`` -> ``spark_hvd`` import alias in every Python process started with this folder on
``PYTHONPATH`` (the pytest process, Spark's Python workers and the ranks): see ``horovod_alias.py``."""

import horovod_alias  # noqa: F401
