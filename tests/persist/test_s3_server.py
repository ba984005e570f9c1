"""The S3 test server itself: data goes through bit-exact, credentials are checked,
data outlives a restart."""

from __future__ import annotations

import os
import time

import pytest


def test_round_trip_bit_exact(s3_bucket):
    server, url = s3_bucket
    fs = server.filesystem()
    small = os.urandom(1000)
    big = os.urandom(13 << 20)  # over s3fs's 5 MiB block: a multipart upload of three parts
    fs.pipe(f"{url}/small", small)
    with fs.open(f"{url}/dir/big", "wb", block_size=5 << 20) as f:
        f.write(big)
    fresh = server.filesystem()
    assert fresh.cat(f"{url}/small") == small
    assert fresh.cat(f"{url}/dir/big") == big
    assert fresh.info(f"{url}/dir/big")["size"] == len(big)
    assert sorted(fresh.find(url)) == sorted([f"{url[5:]}/small", f"{url[5:]}/dir/big"])


def test_credentials_are_checked(s3_bucket):
    server, url = s3_bucket
    server.filesystem().pipe(f"{url}/obj", b"secret data")
    with pytest.raises(PermissionError):
        server.filesystem(secret=server.secret + "x").cat(f"{url}/obj")
    with pytest.raises(PermissionError):
        server.filesystem(anon=True).cat(f"{url}/obj")


def test_missing_bucket_is_an_error(s3_server):
    fs = s3_server.filesystem()
    with pytest.raises(FileNotFoundError):
        fs.pipe("no-such-bucket-here/obj", b"x")  # no bucket created on the fly, as on AWS


def test_data_survives_restart(s3_bucket):
    server, url = s3_bucket
    data = os.urandom(3 << 20)
    server.filesystem().pipe(f"{url}/obj", data)
    endpoint = server.endpoint_url
    server.restart()
    assert server.endpoint_url == endpoint
    assert server.filesystem().cat(f"{url}/obj") == data


def test_stopped_server_fails_fast(s3_bucket):
    """With the server down a request fails within seconds (low timeouts and retries in storage_options);
    the fixture brings the server back for the next test."""
    server, url = s3_bucket
    fs = server.filesystem()
    fs.pipe(f"{url}/obj", b"x")
    server.stop()
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Could not connect"):  # botocore's EndpointConnectionError
        fs.cat(f"{url}/obj")
    assert time.monotonic() - t0 < 15
