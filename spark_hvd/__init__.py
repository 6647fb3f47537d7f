"""spark_hvd: distributed deep learning for Spark users over a ring-allreduce core.

Importing this package is cheap: it imports no torch, tensorflow or pyspark. Use the layer you need:

- ``spark_hvd.torch`` / ``spark_hvd.keras``: the Horovod API (``hvd.init()``, ``hvd.DistributedOptimizer`` ...);
- ``spark_hvd.store``: ``Store.create(url)`` for local, DBFS, HDFS, S3 and any fsspec URL;
- ``spark_hvd.runner``: ``run(fn, num_proc)`` on a Spark barrier stage, ``spark-hvd-run`` for local processes;
- ``spark_hvd.estimators``: ``TorchEstimator`` / ``KerasEstimator``, Spark ML Estimators.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
