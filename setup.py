"""spark_hvd: distributed deep learning on Spark over a ring-allreduce core (configuration in setup.cfg)."""

from setuptools import setup

setup()
