"""The S3 server's own rate, with no GPU: GET of the first N objects of the COCO-sized set
(`scripts/gpu_check.sh s3` serves /tmp/gpudet-images as bucket `coco`) from P processes of T
threads each, obstore's get. What the server gives a plain client, beside what gpudet gets from it.
With --reader, gpudet's reader instead (source.read_chunks: batches of 32 URLs, T requests in
flight, P fetching processes, the header checks), consumed as fast as it gives: what the loop
could get from it with nothing else running. Each run first lists the bucket (its time printed).

    python scripts/s3_rate.py ENDPOINT P T N [--reader]
"""
import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

KEY, SECRET = "gpudetkey", "gpudetsecret"


def store_of(endpoint: str):
    from obstore.store import S3Store
    return S3Store("coco", endpoint=endpoint, region="us-east-1", access_key_id=KEY, secret_access_key=SECRET,
                   client_options={"allow_http": True})


def work(args):
    endpoint, keys, threads = args
    import obstore
    store = store_of(endpoint)
    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(lambda k: len(obstore.get(store, k).bytes()), keys))


def raw(endpoint: str, keys: list[str], procs: int, threads: int) -> int:
    with get_context("spawn").Pool(procs) as pool:
        return sum(pool.map(work, [(endpoint, keys[i::procs], threads) for i in range(procs)]))


def reader(endpoint: str, keys: list[str], procs: int, requests: int) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.update(AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1")
    from pipeline import storage
    from pipeline.results import ImageRef
    from pipeline.source import EncodedImage, batched, read_chunks
    storage.set_options([f"endpoint_url={endpoint}"])
    refs = [ImageRef(i, f"s3://coco/{k}") for i, k in enumerate(keys)]
    total = 0
    for batch in read_chunks(batched(refs, 32), batch_size=32, num_threads=4, remote_requests=requests,
                             remote_processes=procs):
        total += sum(item.data.nbytes for item in batch if isinstance(item, EncodedImage))
    return total


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("endpoint", help="the server, e.g. http://127.0.0.1:9123")
    parser.add_argument("processes", type=int)
    parser.add_argument("threads", type=int, help="threads per process (--reader: requests in flight)")
    parser.add_argument("objects", type=int, help="the first N objects of the set")
    parser.add_argument("--reader", action="store_true", help="gpudet's reader, not a plain client")
    args = parser.parse_args()
    endpoint, procs, threads, n = args.endpoint, args.processes, args.threads, args.objects
    import obstore
    t0 = time.perf_counter()
    listed = sorted(meta["path"] for page in obstore.list(store_of(endpoint)) for meta in page)
    listing_s = time.perf_counter() - t0
    keys = [k for k in listed if k.endswith(".jpg")][:n]
    t0 = time.perf_counter()
    total = reader(endpoint, keys, procs, threads) if args.reader else raw(endpoint, keys, procs, threads)
    dt = time.perf_counter() - t0
    who = f"gpudet's reader, {procs} processes, {threads} requests" if args.reader else \
        f"{procs} processes x {threads} threads"
    print(f"{who}: {len(keys) / dt:.0f} objects/s, {total / dt / 1e6:.0f} MB/s (listing {len(listed)} objects: "
          f"{listing_s:.2f} s)", flush=True)
