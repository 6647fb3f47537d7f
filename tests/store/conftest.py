"""Fixtures of the store tests: a moto S3 server on a free local port, and one store per backend."""

from __future__ import annotations

import errno
import os
import sys
import uuid

import pytest
from helpers.moto_s3 import MOTO, moto_s3_endpoint, s3_options


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """``http://127.0.0.1:<port>`` of a moto S3 server started for this session and stopped afterwards."""
    if not os.path.exists(MOTO):
        pytest.skip(f"moto_server not installed beside {sys.executable}")
    with moto_s3_endpoint(str(tmp_path_factory.mktemp("moto") / "moto.log")) as url:
        yield url


@pytest.fixture(scope="session")
def s3_bucket(s3_endpoint):
    """A bucket on the moto server."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_options(s3_endpoint))
    fs.mkdir("spark-hvd-test")
    return "spark-hvd-test"


def make_store(kind: str, request, tmp_path):
    """A fresh, empty store of ``kind``: local, memory, s3 (the moto server) or dbfs (a FUSE root in tmp_path)."""
    from spark_hvd.store import Store

    if kind == "local":
        return Store.create(str(tmp_path / "store"))
    if kind == "memory":
        return Store.create(f"memory://spark-hvd-{uuid.uuid4().hex[:8]}/store")
    if kind == "dbfs":
        return Store.create("dbfs:/ml/store", fuse_root=str(tmp_path / "dbfs"))
    if kind == "volumes":
        root = request.getfixturevalue("volumes_mount")
        return Store.create("/Volumes/main/ml/artifacts/store", fuse_root=root)
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return Store.create(f"s3://{bucket}/{uuid.uuid4().hex[:8]}", **s3_options(endpoint))


@pytest.fixture
def volumes_mount(tmp_path, monkeypatch):
    """A directory standing in for a Unity Catalog volume mount, with the mount's limits: under it, opening a
    file to append or to write in place (modes with ``a`` or ``+``), renaming and hard links fail as users report the
    mount fails them (append: "Illegal seek"; rename, link: ENOSYS; docs/stores.md)."""
    import builtins
    import shutil

    root = str(tmp_path / "uc")
    os.makedirs(os.path.join(root, "Volumes", "main", "ml", "artifacts"))
    real_open, real_rename, real_replace, real_move, real_link = builtins.open, os.rename, os.replace, shutil.move, \
        os.link

    def under(*paths) -> bool:
        return any(isinstance(p, str | os.PathLike) and os.path.abspath(os.fspath(p)).startswith(root)
                   for p in paths)

    def refused(what: str, path, code: int = errno.ENOSYS) -> OSError:
        return OSError(code, f"simulated Unity Catalog volume: {what} is not supported", str(path))

    def vopen(file, mode="r", *args, **kwargs):
        if under(file) and ("a" in mode or "+" in mode):
            raise refused(f"open(mode={mode!r})", file, errno.ESPIPE)
        return real_open(file, mode, *args, **kwargs)

    def vlink(src, dst, *args, **kwargs):
        if under(src, dst):
            raise refused("link", src)
        return real_link(src, dst, *args, **kwargs)

    def vrename(src, dst, *args, **kwargs):
        if under(src, dst):
            raise refused("rename", src)
        return real_rename(src, dst, *args, **kwargs)

    def vreplace(src, dst, *args, **kwargs):
        if under(src, dst):
            raise refused("rename", src)
        return real_replace(src, dst, *args, **kwargs)

    def vmove(src, dst, *args, **kwargs):
        if under(src, dst):
            raise refused("rename", src)
        return real_move(src, dst, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", vopen)
    monkeypatch.setattr(os, "rename", vrename)
    monkeypatch.setattr(os, "replace", vreplace)
    monkeypatch.setattr(shutil, "move", vmove)
    monkeypatch.setattr(os, "link", vlink)
    return root


@pytest.fixture(params=["local", "memory", "s3", "volumes"])
def any_store(request, tmp_path):
    """A fresh, empty store of each kind the contract suite runs against."""
    return make_store(request.param, request, tmp_path)


@pytest.fixture(params=["local", "memory", "s3", "dbfs", "volumes"])
def durable_store(request, tmp_path):
    """A fresh, empty store of each kind, DBFS included (the checkpoint durability suite)."""
    return make_store(request.param, request, tmp_path)
