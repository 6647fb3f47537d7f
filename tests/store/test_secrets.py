"""A store saved without its secrets: what is dropped, what the pickle holds, how the secrets come back."""

from __future__ import annotations

import json
import logging
import pickle

import pytest

from spark_hvd.store import Store, StoreURLError
from spark_hvd.store.secrets import STORAGE_OPTIONS_ENV, split_secrets

KEY, SECRET, TOKEN = "AKIAEXAMPLEKEY9F3Q", "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY", "tok-9c1e77d0a4"


class _Credentials:
    """An object holding a secret (as botocore/google credentials objects do)."""

    def __init__(self) -> None:
        self.value = SECRET


def _s3(**extra):
    return Store.create("s3://bucket/prefix", key=KEY, secret=SECRET, endpoint_url="http://127.0.0.1:9",
                        client_kwargs={"region_name": "eu-west-1", "aws_session_token": TOKEN}, **extra)


def test_split_secrets_names_what_it_drops():
    public, dropped = split_secrets({"key": KEY, "secret": SECRET, "endpoint_url": "u", "anon": False,
                                     "client_kwargs": {"region_name": "r", "aws_session_token": TOKEN},
                                     "sas_token": "s", "account_name": "acct", "password": "p",
                                     "credentials": "c", "session": _Credentials()})
    assert public == {"endpoint_url": "u", "anon": False, "client_kwargs": {"region_name": "r"},
                      "account_name": "acct"}
    assert sorted(dropped) == ["client_kwargs.aws_session_token", "credentials", "key", "password", "sas_token",
                               "secret", "session"]


def test_pickle_for_shipping_keeps_secrets_saved_pickle_does_not(monkeypatch):
    monkeypatch.delenv(STORAGE_OPTIONS_ENV, raising=False)
    store = _s3()
    shipped = pickle.dumps(store)  # to the training processes: they need the credentials
    assert KEY.encode() in shipped and pickle.loads(shipped) == store
    saved = pickle.dumps(store.without_secrets())
    for secret in (KEY, SECRET, TOKEN):
        assert secret.encode() not in saved
    back = pickle.loads(saved)
    assert back.url == store.url
    assert back.storage_options == {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "eu-west-1"}}
    again = back.with_options(key=KEY, secret=SECRET, client_kwargs={"aws_session_token": TOKEN})
    assert again == store


def test_secrets_come_back_from_the_environment(monkeypatch, caplog):
    saved = pickle.dumps(_s3().without_secrets())
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps({"key": KEY, "secret": SECRET}))
    with caplog.at_level(logging.INFO, logger="spark_hvd.store.secrets"):
        back = pickle.loads(saved)
    assert back.storage_options["key"] == KEY and back.storage_options["secret"] == SECRET
    assert "client_kwargs.aws_session_token" in caplog.text and "'key'" not in caplog.text  # only what is missing
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, "[1, 2]")
    with pytest.raises(StoreURLError, match="JSON object"):
        pickle.loads(saved)


def test_saved_s3_store_works_with_secrets_from_the_environment(s3_endpoint, s3_bucket, monkeypatch):
    store = Store.create(f"s3://{s3_bucket}/secrets", key="testing", secret="testing", endpoint_url=s3_endpoint)
    store.write_bytes(store.path("f"), b"data")
    saved = pickle.dumps(store.without_secrets())
    assert b"testing" not in saved
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, json.dumps({"key": "testing", "secret": "testing"}))
    assert pickle.loads(saved).read_bytes(store.path("f")) == b"data"


def test_local_and_dbfs_stores_lose_nothing(tmp_path):
    for store in (Store.create(str(tmp_path / "l")), Store.create("dbfs:/x", fuse_root=str(tmp_path / "d"))):
        assert pickle.loads(pickle.dumps(store.without_secrets())) == store
