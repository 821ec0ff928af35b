"""Sources in object storage and on web servers, against real servers on 127.0.0.1: moto's S3
server, and an HTTP server that can be told to fail requests."""

import http.server
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import SAMPLES, batched_constant_model, gpudet, one_clear_line, read_jsonl

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
IMAGES = sorted(p.name for p in SAMPLES.iterdir() if p.suffix in (".png", ".jpg"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server, the samples under s3://photos/set/; its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    client.create_bucket(Bucket="photos")
    for name in IMAGES + ["ATTRIBUTION.md"]:
        client.upload_file(str(SAMPLES / name), "photos", f"set/{name}")
    yield endpoint
    server.stop()


def on_s3(*args, endpoint: str, env: dict | None = None):
    device = ["--device", "cpu"] if args[0] == "detect" else []
    return gpudet(*args, *device, "--storage-option", f"endpoint_url={endpoint}",
                  env={**os.environ, **CREDENTIALS, **(env or {})})


def without_paths(records: list[dict]) -> list[dict]:
    return [{**r, "path": Path(r["path"]).name} for r in records]


def test_a_prefix_in_s3_gives_the_records_the_folder_gives(s3, tmp_path):
    local = gpudet("detect", SAMPLES, "--out", tmp_path / "local", "--device", "cpu")
    assert local.returncode == 0, local.stderr
    run = on_s3("detect", "s3://photos/set/", "--out", tmp_path / "s3", endpoint=s3)
    assert run.returncode == 0, run.stderr
    records = read_jsonl(tmp_path / "s3" / "detections.jsonl")
    assert [r["path"] for r in records] == [f"s3://photos/set/{name}" for name in IMAGES]
    assert without_paths(records) == without_paths(read_jsonl(tmp_path / "local" / "detections.jsonl"))
    assert endpoint_not_in(tmp_path / "s3", s3)


def test_a_prefix_the_back_end_cannot_list_is_one_line(s3, tmp_path):
    """An option the back-end does not take, a missing object as the source, or no credentials:
    one line, exit 2, no traceback."""
    run = on_s3("detect", "s3://photos/set/", "--out", tmp_path / "o", "--storage-option", "bogus=1", endpoint=s3)
    one_clear_line(run, 2, "s3://photos/set/", "--storage-option")
    run = on_s3("detect", "s3://photos/set/", "--out", tmp_path / "o", "--storage-option", "key=a",
                "--storage-option", "username=b", endpoint=s3)  # s3fs: a KeyError
    one_clear_line(run, 2, "--storage-option", "not both")
    run = on_s3("detect", "s3://photos/set/none.jpg", "--out", tmp_path / "o", endpoint=s3)  # as a missing file is
    one_clear_line(run, 2, "s3://photos/set/none.jpg", "does not exist")
    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    run = gpudet("detect", "s3://photos/set/", "--out", tmp_path / "o", "--storage-option", f"endpoint_url={s3}",
                 env={**bare, "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none")})
    one_clear_line(run, 2, "s3://photos/set/", "credentials")


def test_s3_objects_come_through_obstore_and_what_it_fails_through_s3fs(s3, monkeypatch):
    """storage.fetch of S3 URLs: obstore fetches them with s3fs's endpoint and credentials (a
    missing object is `missing` at once); a store that has failed every request it made (here: one
    pointed at a port nobody listens on) leaves them to s3fs, which fetches the same bytes, and the
    rest of the run goes through s3fs alone."""
    from obstore.store import S3Store

    from pipeline import storage

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    storage.set_options([f"endpoint_url={s3}"])
    try:
        urls = [f"s3://photos/set/{name}" for name in IMAGES]
        truth = {url: (SAMPLES / url.rsplit("/", 1)[1]).read_bytes() for url in urls}
        got = storage.fetch(urls + ["s3://photos/set/none.jpg"])
        assert {url: got[url] for url in urls} == truth
        assert got["s3://photos/set/none.jpg"].reason == "missing"
        fs, _ = storage.fs_of(urls[0])
        assert storage.FAST[(id(fs), "photos")] is not None and (id(fs), "photos") in storage.SERVED
        assert sorted(storage.fast_find(fs, "photos/set/")) == sorted(fs.find("photos/set/"))  # listed by obstore

        read = storage.read_url(urls[0])  # one object, as draw_detections reads a record's URL: bytes
        assert type(read) is bytes and read == truth[urls[0]]
        from pipeline.draw import draw_detections
        local = draw_detections({"path": str(SAMPLES / IMAGES[0]), "detections": []})
        assert draw_detections({"path": urls[0], "detections": []}).tobytes() == local.tobytes()

        storage.SERVED.discard((id(fs), "photos"))  # as if new: a store that has never answered, here unreachable
        closed = f"http://127.0.0.1:{free_port()}"
        storage.FAST[(id(fs), "photos")] = S3Store("photos", endpoint=closed, region="us-east-1", skip_signature=True,
                                                    client_options={"allow_http": True},
                                                    retry_config={"max_retries": 0})
        assert storage.fetch(urls) == truth
        assert storage.FAST[(id(fs), "photos")] is None
        assert storage.fetch(urls[:2]) == {url: truth[url] for url in urls[:2]}
    finally:
        storage.set_options([])


def test_without_obstore_s3_objects_come_through_s3fs(s3, monkeypatch):
    """gpudet[s3] installed before obstore joined it: s3fs lists and fetches every object, nothing
    fails."""
    import sys

    from pipeline import storage

    for name in ("obstore", "obstore.store", "obstore.exceptions"):
        monkeypatch.setitem(sys.modules, name, None)  # import obstore raises ImportError
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(storage, "FAST", {})
    storage.set_options([f"endpoint_url={s3}"])
    try:
        urls = [f"s3://photos/set/{name}" for name in IMAGES]
        assert storage.fetch(urls) == {url: (SAMPLES / url.rsplit("/", 1)[1]).read_bytes() for url in urls}
        assert storage.list_url("s3://photos/set/", frozenset({".jpg", ".png"})) == sorted(urls)  # listed by s3fs
    finally:
        storage.set_options([])


AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
"""Azurite's well-known development account key (public, in Microsoft's docs)."""


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    """Azurite's blob service (the Makefile installs it with npm), the samples under
    az://photos/set/; its connection string."""
    import subprocess
    import sys
    import time

    binary = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    if not binary.exists():
        pytest.skip("Azurite is not installed: `make` installs it where npm is")
    from azure.storage.blob import BlobServiceClient

    port = free_port()
    server = subprocess.Popen([str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--silent",
                               "--skipApiVersionCheck", "--location", str(tmp_path_factory.mktemp("azurite"))],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    connection = (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};"
                  f"BlobEndpoint=http://127.0.0.1:{port}/devstoreaccount1;")
    for _ in range(300):  # listening? (the client's own retries back off for minutes)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    container = BlobServiceClient.from_connection_string(connection).get_container_client("photos")
    container.create_container()
    for name in IMAGES:
        container.upload_blob(f"set/{name}", (SAMPLES / name).read_bytes())
    yield connection
    server.kill()  # it waits on open connections for minutes after a SIGTERM; its data is a temporary folder
    server.wait()


def test_a_prefix_in_azure_blob_storage_gives_the_records_the_folder_gives(azurite, tmp_path):
    """az:// through adlfs against Azurite: a prefix lists and reads as the folder does, a listed
    blob that is not there is `missing`, and the connection string (it holds the key) reaches no
    output file."""
    local = gpudet("detect", SAMPLES, "--out", tmp_path / "local", "--device", "cpu")
    assert local.returncode == 0, local.stderr
    option = ["--storage-option", f"connection_string={azurite}"]
    run = gpudet("detect", "az://photos/set/", "--out", tmp_path / "az", "--device", "cpu", *option)
    assert run.returncode == 0, run.stderr
    records = read_jsonl(tmp_path / "az" / "detections.jsonl")
    assert [r["path"] for r in records] == [f"az://photos/set/{name}" for name in IMAGES]
    assert without_paths(records) == without_paths(read_jsonl(tmp_path / "local" / "detections.jsonl"))
    assert endpoint_not_in(tmp_path / "az", AZURITE_KEY)
    listing = tmp_path / "list.txt"
    listing.write_text(f"az://photos/set/{IMAGES[0]}\naz://photos/set/none.jpg\n")
    run = gpudet("detect", listing, "--out", tmp_path / "list", "--device", "cpu", *option)
    assert run.returncode == 3, run.stderr
    assert [r["path"] for r in read_jsonl(tmp_path / "list" / "detections.jsonl")] == [f"az://photos/set/{IMAGES[0]}"]
    assert [(e["path"], e["reason"]) for e in read_jsonl(tmp_path / "list" / "errors.jsonl")] == [
        ("az://photos/set/none.jpg", "missing")]


@pytest.fixture(scope="module")
def gcs():
    """gcp-storage-emulator's server (in memory), the samples under gs://photos/set/; its endpoint."""
    import subprocess
    import sys
    import time

    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "gcp-storage-emulator"), "start", "--host",
                               "127.0.0.1", "--port", str(port), "--in-memory"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    endpoint = f"http://127.0.0.1:{port}"
    import requests

    requests.post(f"{endpoint}/storage/v1/b", params={"project": "test"}, json={"name": "photos"}, timeout=10)
    for name in IMAGES:
        requests.post(f"{endpoint}/upload/storage/v1/b/photos/o", params={"uploadType": "media", "name": f"set/{name}"},
                      data=(SAMPLES / name).read_bytes(), timeout=10).raise_for_status()
    yield endpoint
    server.kill()
    server.wait()


def test_a_prefix_in_google_cloud_storage_gives_the_records_the_folder_gives(gcs, tmp_path):
    """gs:// through gcsfs against an emulator (an endpoint without Google's control plane, which
    gcsfs asks each bucket's layout, 60 s a try): a prefix lists and reads as the folder does, and
    the endpoint reaches no output file."""
    local = gpudet("detect", SAMPLES, "--out", tmp_path / "local", "--device", "cpu")
    assert local.returncode == 0, local.stderr
    run = gpudet("detect", "gs://photos/set/", "--out", tmp_path / "gs", "--device", "cpu", "--storage-option",
                 f"endpoint_url={gcs}", "--storage-option", "token=anon", timeout=60)
    assert run.returncode == 0, run.stderr
    records = read_jsonl(tmp_path / "gs" / "detections.jsonl")
    assert [r["path"] for r in records] == [f"gs://photos/set/{name}" for name in IMAGES]
    assert without_paths(records) == without_paths(read_jsonl(tmp_path / "local" / "detections.jsonl"))
    assert endpoint_not_in(tmp_path / "gs", gcs)


def endpoint_not_in(folder: Path, endpoint: str) -> bool:
    """No file of an output folder holds the storage option's value."""
    return all(endpoint not in p.read_text(errors="replace") for p in folder.iterdir() if p.is_file())


def test_a_glob_a_list_of_urls_and_missing_objects_and_resume(s3, tmp_path):
    """A glob on a prefix; a list mixing URLs, a local path and a missing object (recorded
    missing); --resume over it processes nothing twice; gpudet draw reads the images from S3."""
    run = on_s3("detect", "s3://photos/set/*.jpg", "--out", tmp_path / "glob", endpoint=s3)
    assert run.returncode == 0, run.stderr
    assert [r["path"] for r in read_jsonl(tmp_path / "glob" / "detections.jsonl")] == \
        ["s3://photos/set/china.jpg", "s3://photos/set/grace_hopper.jpg"]
    listing = tmp_path / "list.txt"
    listing.write_text(f"s3://photos/set/astronaut.png\n{SAMPLES / 'camera.png'}\ns3://photos/set/nothing.jpg\n")
    run = on_s3("detect", listing, "--out", tmp_path / "o", endpoint=s3)
    assert run.returncode == 3, run.stderr
    (missing,) = read_jsonl(tmp_path / "o" / "errors.jsonl")
    assert missing["reason"] == "missing" and missing["path"] == "s3://photos/set/nothing.jpg"
    assert len(read_jsonl(tmp_path / "o" / "detections.jsonl")) == 2
    again = on_s3("detect", listing, "--out", tmp_path / "o", "--resume", endpoint=s3)
    assert again.returncode == 3 and "nothing left to process" in again.stdout, again.stdout
    assert len(read_jsonl(tmp_path / "o" / "detections.jsonl")) == 2
    drawn = on_s3("draw", tmp_path / "o", "--out", tmp_path / "vis", endpoint=s3)
    assert drawn.returncode == 0 and sorted(p.name for p in (tmp_path / "vis").glob("*.jpg")) == \
        ["00000000_astronaut.jpg", "00000001_camera.jpg"], drawn.stderr


def test_parquet_results_at_an_s3_prefix(s3, tmp_path):
    """--out s3://.../results --format parquet: the run's files go up, summary.json last, and the
    table read back from the prefix is a local run's; a user's object under the prefix stays;
    --resume from a machine whose cache holds nothing of the run (the mirror filled from the
    prefix) processes nothing twice; --overwrite replaces gpudet's objects only, and a machine whose
    mirror is older than the prefix takes the prefix's run; JSONL at a prefix is one line and exit 2."""
    import boto3
    import pyarrow.parquet as pq

    client = boto3.client("s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    client.put_object(Bucket="photos", Key="results/notes.txt", Body=b"mine")

    def run(*args, cache: str):
        return gpudet("detect", "s3://photos/set/", "--out", "s3://photos/results", *args, "--device", "cpu",
                      "--storage-option", f"endpoint_url={s3}",
                      env={**os.environ, **CREDENTIALS, "XDG_CACHE_HOME": str(tmp_path / cache)})

    def objects() -> dict[str, bytes]:
        listed = client.list_objects_v2(Bucket="photos", Prefix="results/").get("Contents", [])
        return {o["Key"][len("results/"):]: client.get_object(Bucket="photos", Key=o["Key"])["Body"].read()
                for o in listed}

    def table(found: dict[str, bytes]) -> list[dict]:
        rows = []
        for name in sorted(n for n in found if n.startswith("detections.parquet/part-")):
            (tmp_path / "part.parquet").write_bytes(found[name])
            rows += pq.read_table(tmp_path / "part.parquet").to_pylist()
        return sorted(rows, key=lambda r: r["index"])

    first = run("--format", "parquet", cache="one")
    assert first.returncode == 0, first.stderr
    found = objects()
    summary = json.loads(found["summary.json"])
    assert found["notes.txt"] == b"mine" and summary["processed"] == len(IMAGES) and "uploaded to s3://" in first.stdout
    assert summary["results"] == "s3://photos/results/detections.parquet" and summary["out"] == "s3://photos/results"
    assert "gpudet" in json.loads(found["settings.json"])
    local = gpudet("detect", SAMPLES, "--out", tmp_path / "local", "--device", "cpu", "--format", "parquet")
    assert local.returncode == 0, local.stderr
    want = pq.read_table(tmp_path / "local" / "detections.parquet").to_pylist()
    got = table(found)
    assert [r["path"] for r in got] == [f"s3://photos/set/{name}" for name in IMAGES]
    assert without_paths(got) == without_paths(sorted(want, key=lambda r: r["index"]))
    assert s3 not in found["settings.json"].decode() + found["summary.json"].decode()

    again = run("--resume", cache="two")  # another machine: its cache holds nothing of this run
    assert again.returncode == 0 and "nothing left to process" in again.stdout, again.stdout + again.stderr
    assert table(objects()) == got

    jsonl = run("--format", "jsonl", "--overwrite", cache="one")
    assert jsonl.returncode == 2 and "--format parquet" in jsonl.stderr and "Traceback" not in jsonl.stderr
    assert objects() == found

    replaced = run("--overwrite", cache="two")
    assert replaced.returncode == 0, replaced.stderr
    after = objects()
    parts = sorted(n for n in after if n.startswith("detections.parquet/"))
    assert after["notes.txt"] == b"mine" and parts and not set(parts) & set(found)  # new parts, the old ones gone
    assert without_paths(table(after)) == without_paths(got)

    stale = run("--resume", cache="one")  # its mirror still holds the run before the overwrite: the prefix wins
    assert stale.returncode == 0 and "nothing left to process" in stale.stdout, stale.stdout + stale.stderr
    assert sorted(n for n in objects() if n.startswith("detections.parquet/")) == parts


def test_the_mirror_keeps_what_it_could_not_upload_until_the_prefix_moves_on(s3, tmp_path, monkeypatch):
    """An object-store --out's mirror against the prefix: a part written here whose upload failed
    stays in the mirror while the prefix is as this mirror left it (the next command uploads it),
    and goes once another machine changed the prefix (the prefix is the run's record); the parts
    an --overwrite removed go from the prefix with the first upload, and a settings.json of the
    same size but other content goes up."""
    import boto3

    from pipeline import storage
    from pipeline.mirror import Mirror

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    storage.set_options([f"endpoint_url={s3}"])
    client = boto3.client("s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    mirror = Mirror("s3://photos/kept")
    mirror.pull()
    (mirror.local / "settings.json").write_text('{"gpudet": "0"}')
    (mirror.local / "detections.parquet").mkdir()
    first, second = (f"detections.parquet/part-{n}-0000000{n}.parquet" for n in (1, 2))
    (mirror.local / first).write_bytes(b"one")
    mirror.push(final=True)
    (mirror.local / second).write_bytes(b"two")  # written here; its upload never happened
    mirror.release()

    again = Mirror("s3://photos/kept")
    again.pull()
    assert (again.local / second).read_bytes() == b"two"
    again.push(final=True)
    assert client.get_object(Bucket="photos", Key=f"kept/{second}")["Body"].read() == b"two"
    again.release()

    (again.local / "detections.parquet" / "part-3-00000003.parquet").write_bytes(b"three")  # not uploaded
    client.delete_object(Bucket="photos", Key=f"kept/{first}")  # another machine's --overwrite, say
    later = Mirror("s3://photos/kept")
    later.pull()
    assert sorted(p.name for p in (later.local / "detections.parquet").iterdir()) == ["part-2-00000002.parquet"]

    # --overwrite here: the old part goes from the prefix with the first upload, not only at the end
    (later.local / second).unlink()
    (later.local / "detections.parquet" / "part-4-00000004.parquet").write_bytes(b"four")
    (later.local / "settings.json").write_text('{"gpudet": "1"}')  # the same size, other settings
    later.push()  # the run goes on (or is killed after this)
    later.release()
    listed = client.list_objects_v2(Bucket="photos", Prefix="kept/detections.parquet/")["Contents"]
    assert [o["Key"].rsplit("/", 1)[1] for o in listed] == ["part-4-00000004.parquet"]
    assert client.get_object(Bucket="photos", Key="kept/settings.json")["Body"].read() == b'{"gpudet": "1"}'
    resumed = Mirror("s3://photos/kept")
    resumed.pull()
    assert sorted(p.name for p in (resumed.local / "detections.parquet").iterdir()) == ["part-4-00000004.parquet"]

    # another command on this prefix on this machine, while this one holds it: one line, exit 2, nothing touched
    run = on_s3("detect", SAMPLES, "--out", "s3://photos/kept", "--format", "parquet", endpoint=s3,
                env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert run.returncode == 2 and "in use by another gpudet run" in run.stderr and "Traceback" not in run.stderr, \
        run.stderr
    assert sorted(p.name for p in (resumed.local / "detections.parquet").iterdir()) == ["part-4-00000004.parquet"]
    resumed.release()
    storage.set_options([])


def moto_process(port: int, *, authorised_requests: float = float("inf")):
    """moto's S3 server in a process of its own, with the samples under s3://photos/set/, that
    honours the credentials for its first `authorised_requests` requests (setting up included) and
    refuses every one after, as a store does once a session token expires."""
    import subprocess
    import sys
    import time

    import boto3

    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(authorised_requests)}
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in CREDENTIALS.items()
                                                          if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
    for _ in range(100):
        try:
            client.create_bucket(Bucket="photos")
            break
        except Exception:  # not listening yet
            time.sleep(0.1)
    for name in IMAGES:
        client.put_object(Bucket="photos", Key=f"set/{name}", Body=(SAMPLES / name).read_bytes())
    return server, endpoint


@pytest.mark.parametrize("executor", [[], ["--devices", "cpu,cpu"]], ids=["one process", "devices"])
def test_credentials_refused_mid_run_stop_it_with_one_line_and_resume_finishes(tmp_path, executor):
    """The store honours the credentials for the first images and refuses everything after: exit 2,
    one line saying so and what to do, the images read before recorded (none recorded forbidden);
    --resume against a store that honours them records the rest, each image once. The same with
    --devices workers, each of which meets the refusal in its own process."""
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"s3://photos/set/{name}\n" for name in IMAGES * 4))  # 24 images
    port = free_port()
    reads = 20 if executor else 16  # of 24 GETs; 12 images a worker: each worker is served some before the refusals
    server, endpoint = moto_process(port, authorised_requests=1 + len(IMAGES) + reads)  # the bucket, the uploads
    try:
        run = on_s3("detect", listing, "--out", tmp_path / "o", "--batch-size", "2", "--set", "run.num_threads=1",
                    "--set", "run.storage_requests=2", *executor, endpoint=endpoint)  # batches requested in turn
    finally:
        server.terminate()
        server.wait()
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "ERROR" in line]
    if executor:  # each worker meets the refusal and says so; the parent names the workers that stopped
        assert any("credentials" in e for e in errors) and all("--resume" in e for e in errors), run.stderr
    else:
        assert len(errors) == 1 and "credentials" in errors[0] and "--resume" in errors[0], run.stderr
    assert "Traceback" not in run.stderr
    recorded = read_jsonl(tmp_path / "o" / "detections.jsonl")
    failed = read_jsonl(tmp_path / "o" / "errors.jsonl") if (tmp_path / "o" / "errors.jsonl").exists() else []
    assert 0 < len(recorded) < 24 and not failed, (len(recorded), failed, run.stderr)
    server, endpoint = moto_process(port)
    try:
        again = on_s3("detect", listing, "--out", tmp_path / "o", "--resume", endpoint=endpoint)
    finally:
        server.terminate()
        server.wait()
    assert again.returncode == 0, again.stderr
    assert sorted(r["index"] for r in read_jsonl(tmp_path / "o" / "detections.jsonl")) == list(range(24))


def test_a_store_that_refuses_everything_from_the_start_stops_the_run_with_one_line(tmp_path):
    """Credentials the store never honours: the run stops with one line and exit 2 after a few
    objects, rather than recording every image of the list as forbidden."""
    listing = tmp_path / "list.txt"
    listing.write_text("".join(f"s3://photos/set/{name}\n" for name in IMAGES * 4))  # 24 images
    port = free_port()
    server, endpoint = moto_process(port, authorised_requests=1 + len(IMAGES))  # the bucket, the uploads
    try:
        run = on_s3("detect", listing, "--out", tmp_path / "o", "--batch-size", "2", endpoint=endpoint)
    finally:
        server.terminate()
        server.wait()
    one_clear_line(run, 2, "refused every object", "credentials")
    errors = tmp_path / "o" / "errors.jsonl"
    assert not errors.exists() or len(read_jsonl(errors)) < 24


class Flaky(http.server.SimpleHTTPRequestHandler):
    """Serves samples/ (any query); every `fail_every`-th request for an image gets a 503, but no URL
    more than `fails_per_url` times (within storage.TRIES, however the retries of concurrent
    fetchers line up); /forbidden/ a 403."""

    requests = 0
    fail_every = 3
    fails_per_url = 2
    failed: dict[str, int] = {}
    lock = threading.Lock()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=str(SAMPLES), **kwargs)

    def do_GET(self):
        if self.path.startswith("/forbidden/"):
            self.send_error(403)
            return
        with Flaky.lock:
            Flaky.requests += 1
            fail = Flaky.requests % Flaky.fail_every == 0 and Flaky.failed.get(self.path, 0) < Flaky.fails_per_url
            if fail:
                Flaky.failed[self.path] = Flaky.failed.get(self.path, 0) + 1
        if fail:
            self.send_error(503)
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Flaky.requests, Flaky.failed = 0, {}
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_third_of_the_requests_failing_transiently_still_records_every_image_once(flaky_server, tmp_path):
    listing = tmp_path / "urls.txt"
    urls = [f"{flaky_server}/{name}?copy={copy}" for copy in range(4) for name in IMAGES]  # 24 objects
    listing.write_text("\n".join(urls + [f"{flaky_server}/forbidden/a.jpg", f"{flaky_server}/none.jpg"]) + "\n")
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--device", "cpu", "--batch-size", "4")
    assert run.returncode == 3, run.stderr
    records = read_jsonl(tmp_path / "o" / "detections.jsonl")
    assert sorted(r["index"] for r in records) == list(range(24))
    failures = sum(Flaky.failed.values())  # each answered by exactly one more request; none.jpg's 404 by none
    assert Flaky.requests == 25 + failures and failures >= 6, (Flaky.failed, Flaky.requests)
    failed = {e["path"]: e["reason"] for e in read_jsonl(tmp_path / "o" / "errors.jsonl")}
    assert failed == {f"{flaky_server}/forbidden/a.jpg": "forbidden", f"{flaky_server}/none.jpg": "missing"}, failed


class Named(http.server.SimpleHTTPRequestHandler):
    """Serves grace_hopper.jpg as /a[1].jpg and china.jpg under any other name, any query; notes
    each request's path."""

    seen: list[str] = []
    listing: Path

    def translate_path(self, path):
        from urllib.parse import unquote, urlsplit

        Named.seen.append(unquote(path))
        name = unquote(urlsplit(path).path)
        if name == "/d/list.txt":
            return str(Named.listing)
        return str(SAMPLES / ("grace_hopper.jpg" if name == "/a[1].jpg" else "china.jpg"))

    def log_message(self, *args):
        pass


def test_a_presigned_url_and_a_bracketed_name_are_fetched_as_written(tmp_path):
    """fsspec's cat takes `?` and `[` for a glob: it lists first, one URL at a time, and `a[1]`
    matches `a1`. Each URL here is one request for exactly that object, with no S3 option. A
    presigned list is a list, read as a local one is: its relative lines against its folder, `/x`
    against the host, `./` and `..` folded, the byte-order mark, `\\r` and comments left out."""
    from pipeline import storage

    Named.listing = tmp_path / "list.txt"
    Named.listing.write_bytes(b"\xef\xbb\xbfx.jpg\r\nsub/y.jpg?v=2\n./#z.jpg\n../up.jpg\n/top.jpg\n\n# a comment\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Named)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    urls = [f"{base}/photo{i}.jpg?X-Amz-Expires=3600&X-Amz-Signature=f00{i}" for i in range(8)] + [f"{base}/a[1].jpg"]
    Named.seen = []
    storage.set_options(["endpoint_url=http://127.0.0.1:9"])  # an S3 store's option: web URLs take none
    try:
        got = storage.fetch(urls)
        assert storage.list_url(f"{base}/d/list.txt?X-Amz-Signature=f00", frozenset()) == [
            f"{base}/d/x.jpg", f"{base}/d/sub/y.jpg?v=2", f"{base}/d/#z.jpg", f"{base}/up.jpg", f"{base}/top.jpg"]
    finally:
        storage.set_options([])
        server.shutdown()
    china, grace = ((SAMPLES / name).read_bytes() for name in ("china.jpg", "grace_hopper.jpg"))
    assert got == {**{url: china for url in urls[:-1]}, urls[-1]: grace}
    assert sorted(Named.seen) == sorted([url.removeprefix(base) for url in urls] + ["/d/list.txt?X-Amz-Signature=f00"])


class Listed(http.server.SimpleHTTPRequestHandler):
    """Serves /list.txt (two image lines) once a load has begun (`loading`), noting that it was
    asked for and whether that load began within 10 s; 404 for anything else."""

    asked, loading = threading.Event(), threading.Event()
    answered_while_loading = None

    def do_GET(self):
        if self.path != "/list.txt":
            self.send_error(404)
            return
        Listed.asked.set()
        Listed.answered_while_loading = Listed.loading.wait(timeout=10)
        body = b"a.jpg\nb.jpg\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_url_source_is_listed_while_the_executor_loads(tmp_path, monkeypatch):
    """job.listed: the store is asked for a URL source's listing, and answers, while Executor.load
    runs (the load waits for the request, the answer for the load: one after the other, either
    would wait in vain); the refs are the source's, and a source that does not exist is its one
    error after the load. An executor that loads nothing here (--devices, --ray) lists here."""
    from pipeline.errors import SourceError
    from pipeline.job import listed

    class Loading:
        devices = ["cpu"]
        listing_seen_in_load = None

        def load(self):
            Listed.loading.set()
            self.listing_seen_in_load = Listed.asked.wait(timeout=10)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Listed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        Listed.asked.clear(), Listed.loading.clear()
        executor = Loading()
        refs = listed(f"{base}/list.txt", None, [], executor)
        assert executor.listing_seen_in_load is True and Listed.answered_while_loading is True
        assert [(r.index, r.path) for r in refs] == [(0, f"{base}/a.jpg"), (1, f"{base}/b.jpg")]
        loaded = Loading()
        with pytest.raises(SourceError, match="does not exist"):
            listed(f"{base}/none.txt", None, [], loaded)
        assert loaded.listing_seen_in_load is not None

        class LoadsNothing:  # --devices, --ray: listed here, no process started
            devices, load = ["cuda:0", "cuda:1"], None

        monkeypatch.setattr("pipeline.job.ListedApart", None)
        assert [r.path for r in listed(f"{base}/list.txt", None, [], LoadsNothing())] == [f"{base}/a.jpg", f"{base}/b.jpg"]
    finally:
        server.shutdown()


def test_a_listing_process_not_waited_for_is_ended_and_one_that_cannot_start_lists_here(monkeypatch):
    """listing.ListedApart: closed before its answer (a load that failed, a Ctrl-C), its process is
    killed and waited for, never left behind; where no process can start, refs() lists in this
    process, with the same refs."""
    from pipeline.listing import ListedApart

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Listed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/list.txt"
    try:
        Listed.asked.clear(), Listed.loading.clear()
        apart = ListedApart(url)
        assert Listed.asked.wait(timeout=60)  # its request waits for `loading`, which never comes
        apart.close()
        assert apart.process.returncode == -signal.SIGKILL
        monkeypatch.setattr(sys, "executable", "")
        Listed.loading.set()
        here = ListedApart(url)
        assert here.process is None
        assert [r.path for r in here.refs()] == [url.replace("list.txt", "a.jpg"), url.replace("list.txt", "b.jpg")]
    finally:
        server.shutdown()


MASKS = """
import os, signal
from pipeline.errors import helper_started


def masks():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    blocked, ignored = (int(status[key].split()[0], 16) for key in ("SigBlk", "SigIgn"))
    return [(bool(blocked >> (s - 1) & 1), bool(ignored >> (s - 1) & 1)) for s in (signal.SIGINT, signal.SIGTERM)]


def report(fd, parent):
    before = masks()
    helper_started(parent)
    os.write(fd, repr((before, masks())).encode())
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the signal masks from /proc")
def test_a_helper_process_holds_the_stop_signals_until_it_says_how_it_takes_them(tmp_path, monkeypatch):
    """errors.start_helper: the process starts with SIGINT and SIGTERM held, so a Ctrl-C to the
    whole group in its first tenths of a second (its interpreter starting, its imports) does not
    print a traceback; helper_started then ignores SIGINT (the parent decides) and takes SIGTERM
    back. The parent's own mask is left as it was."""
    from pipeline.errors import start_helper

    (tmp_path / "masked_helper.py").write_text(MASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    read, write = os.pipe()
    try:
        process = start_helper("masked_helper.report", write, os.getpid(), pass_fds=(write,))
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read().decode()
    assert process.wait(timeout=60) == 0
    assert said == repr(([(True, False), (True, False)], [(False, True), (False, False)]))
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}


HELD = """
import signal, sys, threading
from pipeline import storage
storage.fs_of(sys.argv[1])
def held(thread):
    status = open(f"/proc/self/task/{thread.native_id}/status").read()
    mask = int(status.split("SigBlk:")[1].split()[0], 16)
    return all(mask >> (s - 1) & 1 for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
print(sorted((t.name, held(t)) for t in threading.enumerate() if t.name in ("MainThread", "fsspecIO")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads' signal masks from /proc")
@pytest.mark.parametrize("url", ["s3://bucket/a.jpg", "https://example.com/a.jpg"])
def test_the_thread_that_makes_requests_holds_the_stop_signals(url):
    """fsspec's IO thread, made with a URL's filesystem, holds SIGINT, SIGTERM and SIGHUP back, as
    gpudet's own threads do: one handed to it would raise KeyboardInterrupt in the main thread
    wherever that is, in the middle of torch's import too (errors.signals_held). The main thread
    takes them as before."""
    import subprocess

    run = subprocess.run([sys.executable, "-c", HELD, url], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert run.stdout.strip() == "[('MainThread', False), ('fsspecIO', True)]", run.stdout + run.stderr


def test_storage_option_values_never_reach_a_report():
    from pipeline.cli import without_storage_values

    assert without_storage_values(["bench", "s3://b/", "--storage-option", "secret_key=abc",
                                   "--storage-option=key=xyz"]) == \
        ["bench", "s3://b/", "--storage-option", "secret_key=...", "--storage-option=key=..."]
    assert json.dumps(without_storage_values(["--storage-option", "token=t0ps3cret"])).count("t0ps3cret") == 0


def test_ray_actors_fetch_url_sources_themselves(flaky_server, tmp_path):
    """--ray over a list of URLs: the driver lists, the actor fetches (no shared disk needed), with
    the same retries; every image recorded once."""
    Flaky.fail_every = 4
    try:
        listing = tmp_path / "urls.txt"
        listing.write_text("".join(f"{flaky_server}/{name}\n" for name in IMAGES))
        run = gpudet("detect", listing, "--out", tmp_path / "o", "--ray", "--workers", "1", "--device", "cpu",
                     timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        records = read_jsonl(tmp_path / "o" / "detections.jsonl")
        assert sorted(r["index"] for r in records) == list(range(len(IMAGES)))
    finally:
        Flaky.fail_every = 3


def peak_rss_mb(*args) -> tuple[int, float]:
    """gpudet's exit code and its peak resident memory in MB, run under a process of its own (the
    children's maximum is the one child's)."""
    import subprocess
    import sys

    code = ("import resource, subprocess, sys\n"
            "done = subprocess.run([sys.executable, '-m', 'pipeline', *sys.argv[1:]], stdout=subprocess.DEVNULL)\n"
            "print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
    run = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                         env={**os.environ, **CREDENTIALS}, timeout=900)
    returncode, kilobytes = run.stdout.split()
    return int(returncode), int(kilobytes) / 1024


def test_a_prefix_of_ten_thousand_objects_lists_and_runs_with_memory_flat(s3, tmp_path):
    """10,000 tiny PNGs under one prefix, listed and detected (a tiny constant model at 32x32, so
    the objects are the work): every object recorded once; gpudet's peak memory over all 10,000 is
    within 25 MB of its peak over the first 2,500 (the listing holds ~200 bytes an image; records
    and fetched bytes do not pile up)."""
    import io
    from concurrent.futures import ThreadPoolExecutor

    import boto3
    import numpy as np
    from PIL import Image

    client = boto3.client("s3", endpoint_url=s3, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    client.create_bucket(Bucket="tiny")
    png = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), 200, np.uint8)).save(png, format="PNG")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: client.put_object(Bucket="tiny", Key=f"set/{'a' if i < 2500 else 'b'}/{i:05d}.png",
                                                  Body=png.getvalue()), range(10_000)))
    model = batched_constant_model(tmp_path / "one.onnx", {"output0": np.array([[1, 1, 4, 4, 0.9, 0]], np.float32)})
    common = ["--model", model, "--device", "cpu", "--set", "preprocess.size=[32,32]", "--set", "model.landmarks=0",
              "--set", "model.labels=[dot]", "--storage-option", f"endpoint_url={s3}", "--quiet"]
    runs = {}
    for name, source, count in (("quarter", "s3://tiny/set/a/", 2500), ("all", "s3://tiny/set/", 10_000)):
        code, runs[name] = peak_rss_mb("detect", source, "--out", tmp_path / name, *common)
        assert code == 0
        records = read_jsonl(tmp_path / name / "detections.jsonl")
        assert len(records) == count and sorted(r["index"] for r in records) == list(range(count))
    assert runs["all"] - runs["quarter"] < 25, runs  # measured: 760 and 771 MB



def test_an_object_store_source_is_read_further_ahead_within_its_byte_budget(s3, monkeypatch):
    """read_chunks keeps about remote_requests requests in flight over URLs (each batch's objects
    requested at once) and takes REMOTE_SLACK times as many batches ahead, so that one answered
    late does not stop the others; fewer where remote_ahead_bytes holds fewer at the mean object
    size read so far, and local files `lookahead` batches ahead."""
    from pipeline import source, storage
    from pipeline.results import ImageRef

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    storage.set_options([f"endpoint_url={s3}"])
    fetch, lock, in_flight = storage.fetch, threading.Lock(), [0, 0]  # requests now, most at once

    def slow_fetch(urls):  # each call answered after 50 ms, as an object store answers
        with lock:
            in_flight[0] += len(urls)
            in_flight[1] = max(in_flight)
        try:
            threading.Event().wait(0.05)
            return fetch(urls)
        finally:
            with lock:
                in_flight[0] -= len(urls)

    monkeypatch.setattr(storage, "fetch", slow_fetch)

    def ahead_of_each_batch(paths: list[str], **options) -> list[int]:
        """How many batches read_chunks had taken beyond each one it handed on."""
        taken = 0

        def chunks():
            nonlocal taken
            for chunk in source.batched([ImageRef(i, p) for i, p in enumerate(paths)], 4):
                taken += 1
                yield chunk

        ahead = []
        for k, batch in enumerate(source.read_chunks(chunks(), batch_size=4, num_threads=2, **options)):
            assert all(isinstance(item, source.EncodedImage) for item in batch)
            ahead.append(taken - k - 1)
        return ahead

    try:
        urls = [f"s3://photos/set/{name}" for name in IMAGES] * 32
        slack = source.REMOTE_SLACK
        # 16 requests: 4 batches of 4 in flight, 4 * slack taken
        assert ahead_of_each_batch(urls, remote_requests=16)[:8] == [4 * slack] * 8
        assert in_flight[1] == 16, in_flight  # no more in flight than asked for, however far ahead
        # the first batches go out before any object's size is known; then the budget holds
        assert ahead_of_each_batch(urls, remote_requests=16, remote_ahead_bytes=1)[4 * slack:4 * slack + 6] == [2] * 6
        local = [str(SAMPLES / name) for name in IMAGES] * 8
        assert ahead_of_each_batch(local, remote_requests=16)[:8] == [2] * 8
    finally:
        storage.set_options([])


def test_objects_fetched_in_processes_of_their_own_are_those_this_process_fetches(s3, monkeypatch):
    """fetching.FetchProcesses: the same bytes, and the same reason for a missing object, as
    storage.fetch here; after one of its processes is killed, every batch is still answered whole
    (by this process), and the run is told once."""
    from pipeline import storage
    from pipeline.fetching import FetchProcesses

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    storage.set_options([f"endpoint_url={s3}"])

    def plain(answer: dict) -> dict:
        return {url: value.reason if isinstance(value, storage.Unreadable) else bytes(value)
                for url, value in answer.items()}

    processes = None
    try:
        urls = [f"s3://photos/set/{name}" for name in IMAGES] + ["s3://photos/set/none.jpg"]
        truth = plain(storage.fetch(urls))
        assert truth[urls[-1]] == "missing" and all(isinstance(truth[url], bytes) for url in urls[:-1])
        processes = FetchProcesses(2)
        assert [plain(processes.fetch(urls)) for _ in range(4)] == [truth] * 4 and not processes.broken
        killed = processes._children[0].process
        killed.kill()
        killed.wait()
        assert [plain(processes.fetch(urls)) for _ in range(4)] == [truth] * 4 and processes.broken
        processes.close()
        for child in processes._children:  # each waited for: no zombie left behind
            child.reader.join(timeout=10)
            assert child.process.wait(timeout=10) is not None
        monkeypatch.setattr(sys, "executable", "")  # no process can start: this one fetches
        processes = FetchProcesses(2)
        assert processes.broken and plain(processes.fetch(urls)) == truth
    finally:
        if processes is not None:
            processes.close()
        storage.set_options([])


def test_processes_started_early_are_those_the_reader_takes(s3, monkeypatch):
    """fetching.start_early starts the processes while the detector is built, each making its
    clients then (storage.prepare: obstore's store here, without a request); `started` hands them
    over once where as many are asked for, and lets them go for new ones where not."""
    from pipeline import fetching, storage

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(storage, "FAST", {})  # no store an earlier test made or gave up on
    storage.set_options([f"endpoint_url={s3}"])
    taken = []
    try:
        urls = [f"s3://photos/set/{name}" for name in IMAGES]
        storage.prepare(urls[0])
        fs, _ = storage.fs_of(urls[0])
        assert storage.FAST[(id(fs), "photos")] is not None  # the store, made before any fetch
        truth = {url: bytes(value) for url, value in storage.fetch(urls).items()}

        fetching.start_early(2, urls[0])
        early = fetching._early[0]
        taken.append(fetching.started(2))
        assert taken[0] is early and not fetching._early
        assert {url: bytes(value) for url, value in taken[0].fetch(urls).items()} == truth
        taken.append(fetching.started(2))  # none started early any more: new ones
        assert taken[1] is not early and taken[1].processes == 2

        fetching.start_early(2, urls[0])
        early = fetching._early[0]
        taken.append(fetching.started(1))  # not as many: the early ones go
        assert taken[2].processes == 1 and early.closed
        for child in early._children:
            assert child.process.wait(timeout=10) is not None
        fetching.start_early(2, urls[0])
        early = fetching._early[0]
        fetching.drop_early()
        assert early.closed and not fetching._early
    finally:
        for processes in taken:
            processes.close()
        fetching.drop_early()
        storage.set_options([])


def test_a_run_over_urls_starts_its_fetching_processes_while_the_detector_is_built():
    """runner.fetchers_started: a run whose images include a URL starts run.storage_processes
    processes for the block that builds its detector (as many as the reader will ask for), and
    lets go of those no reader took at the block's end; a run of local files, or one with
    storage_processes 0, starts none."""
    from pipeline import fetching
    from pipeline.config import load_config
    from pipeline.results import ImageRef
    from pipeline.runner import fetchers_started

    config = load_config(None)
    local = [ImageRef(i, str(SAMPLES / name)) for i, name in enumerate(IMAGES)]
    mixed = local + [ImageRef(len(local), "s3://photos/set/a.jpg")]
    with fetchers_started(local, config):
        assert not fetching._early
    with fetchers_started(mixed, load_config(None, ["run.storage_processes=0"])):
        assert not fetching._early
    with fetchers_started(mixed, config):
        (early,) = fetching._early
        assert early.processes == config.run.storage_processes and not early.broken
    assert early.closed and not fetching._early
    for child in early._children:
        assert child.process.wait(timeout=10) is not None


def test_a_batch_of_more_objects_than_one_sendmsg_takes_comes_back_whole():
    """fetching.send writes each object from where it is: a batch of more objects than one
    sendmsg call takes buffers (IOV_MAX, 1,024 on Linux; run.batch_size goes to 4,096) is sent in
    several calls, its bytes in order."""
    from pipeline import fetching

    parts = [bytes([i % 251]) * (1 + i % 7) for i in range(fetching.SEND_BUFFERS + 100)]
    ours, theirs = socket.socketpair()
    got = []
    reader = threading.Thread(target=lambda: got.append(fetching.receive(theirs)))
    reader.start()
    try:
        fetching.send(ours, b"head", parts)
        reader.join(timeout=30)
        head, data = got[0]
        assert head == b"head" and bytes(data) == b"".join(parts)
    finally:
        ours.close()
        theirs.close()


def test_an_unreadable_object_says_how_often_it_was_asked_for(flaky_server, monkeypatch):
    """A transient failure is tried TRIES times and says so; one that is not worth a second try
    (refused at once, a malformed request) does not claim tries it never made."""
    from pipeline import storage

    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    monkeypatch.setattr(Flaky, "fail_every", 1)  # every request for an image: 503
    monkeypatch.setattr(Flaky, "fails_per_url", storage.TRIES)
    (answer,) = storage.fetch([f"{flaky_server}/{IMAGES[0]}"]).values()
    assert answer.reason == "unreadable" and f"after {storage.TRIES} tries" in str(answer), answer
    assert str(storage.classified(OSError("bad request"))) == "cannot fetch it: bad request"


def test_only_a_failure_worth_a_second_request_is_tried_again():
    """A 5xx, 429, a reset or a timeout is tried again; a missing or refused object is not, nor is
    a failure whose URL happens to hold such a word or number (a port, a file name)."""
    from pipeline.storage import transient

    class StatusError(OSError):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    assert all(transient(e) for e in (StatusError(503), StatusError(429), OSError("Connection reset by peer"),
                                      TimeoutError(), OSError("HTTP 502 Bad Gateway"), OSError("SlowDown")))
    assert not any(transient(e) for e in (
        StatusError(404), StatusError(403), FileNotFoundError("http://127.0.0.1:50319/none.jpg"),
        PermissionError("s3://b/timeout/a.jpg"), OSError("404 Not Found: http://127.0.0.1:43503/reset.jpg"),
        OSError("bad request for https://h/a_500.jpg")))


def test_an_unreachable_endpoint_stops_a_run_in_seconds(tmp_path):
    """Nothing listens at the endpoint: the run stops with one line and exit 2 after gpudet's own
    tries, not after botocore's and s3fs's retries under each of them (a minute)."""
    listing = tmp_path / "urls.txt"
    listing.write_text("".join(f"s3://photos/set/{k}.jpg\n" for k in range(12)))
    start = time.monotonic()
    run = gpudet("detect", listing, "--out", tmp_path / "o", "--device", "cpu",
                 "--storage-option", f"endpoint_url=http://127.0.0.1:{free_port()}",
                 env={**os.environ, **CREDENTIALS})
    assert run.returncode == 2 and "served none of the objects" in run.stderr, run.stderr
    assert time.monotonic() - start < 40, time.monotonic() - start


def test_draw_fetches_a_chunk_of_url_records_at_once(flaky_server, tmp_path, monkeypatch):
    """gpudet draw over URL records asks the store for FETCHED_AT_ONCE images at once (a slow or
    dead store costs one wait per chunk, not one per image), and names each drawing after the
    image, not the URL's query."""
    from pipeline import draw, storage

    monkeypatch.setattr(Flaky, "fail_every", 10 ** 6)
    monkeypatch.setattr(draw, "FETCHED_AT_ONCE", 4)
    calls = []
    fetch = storage.fetch
    monkeypatch.setattr(storage, "fetch", lambda urls: (calls.append(len(urls)), fetch(urls))[1])
    records = [{"index": k, "path": f"{flaky_server}/{name}?sig={k}", "detections": []}
               for k, name in enumerate(IMAGES)]
    written, skipped = draw.draw_records(records, tmp_path / "drawn")
    assert calls == [4, 2] and not skipped
    assert sorted(p.name for p in written) == sorted(f"{k:08d}_{Path(name).stem}.jpg" for k, name in enumerate(IMAGES))


def test_draw_and_export_read_the_records_at_an_s3_prefix(s3, tmp_path):
    """The prefix a `detect --out s3://...` wrote is what draw and export take, as they take a local
    output folder: its run copied into the local mirror first, the drawings made from the S3
    images the records name; a prefix with no run is one line, exit 2."""
    env = {**os.environ, **CREDENTIALS, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    common = ["--storage-option", f"endpoint_url={s3}"]
    run = gpudet("detect", "s3://photos/set/", "--out", "s3://photos/drawn-run", "--device", "cpu", *common, env=env)
    assert run.returncode == 0, run.stderr
    env["XDG_CACHE_HOME"] = str(tmp_path / "another-machine")  # nothing of the run in this cache
    drawn = gpudet("draw", "s3://photos/drawn-run", "--out", tmp_path / "drawn", *common, env=env)
    assert drawn.returncode == 0, drawn.stderr
    assert len(list((tmp_path / "drawn").glob("*.jpg"))) == len(IMAGES)
    exported = gpudet("export", "s3://photos/drawn-run/", "--format", "csv", "--out", tmp_path / "d.csv", *common,
                      env=env)
    assert exported.returncode == 0 and (tmp_path / "d.csv").read_text().count("s3://photos/set/") >= len(IMAGES)
    none = gpudet("draw", "s3://photos/nothing-here", "--out", tmp_path / "none", *common, env=env)
    one_clear_line(none, 2, "s3://photos/nothing-here", "holds no run")


def test_an_out_prefix_in_a_bucket_that_does_not_exist_is_refused_before_the_run(s3, tmp_path):
    """--out s3://no-such-bucket/results: one line naming the bucket, exit 2, before any image is
    processed (the first upload at the end was where it failed)."""
    run = gpudet("detect", "s3://photos/set/", "--out", "s3://no-such-bucket/results", "--device", "cpu",
                 "--storage-option", f"endpoint_url={s3}",
                 env={**os.environ, **CREDENTIALS, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    one_clear_line(run, 2, "no-such-bucket", "does not exist")
    assert "images" not in run.stdout
