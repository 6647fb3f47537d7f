"""Helpers the tests share, importable from every test folder as ``helpers.<module>`` (``pythonpath = tests`` in
setup.cfg):

- ``ranks``: a job's ranks as local processes; ``engine_scenarios`` / ``device_scenarios``: what those ranks run;
- ``launch``: the bindings' worker scripts under the launcher;
- ``net``: free ports, a recording relay (replay attacks), waiting for a condition;
- ``parquet``: small Parquet datasets; ``moto_s3``: a local S3 server (moto);
- ``estimators`` / ``torch_replay``: estimator scenarios and their single-process reference.
"""
