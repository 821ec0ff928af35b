"""The S3 server's own rate, with no gpudet and no GPU: GET of the first N objects of the COCO-sized
set (`scripts/gpu_check.sh s3` serves /tmp/gpudet-images as bucket `coco`) from P processes of T
threads each, obstore's get. What the server gives a plain client, beside what gpudet gets from it.

    python scripts/s3_rate.py ENDPOINT P T N
"""
import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context


def work(args):
    endpoint, keys, threads = args
    import obstore
    from obstore.store import S3Store
    store = S3Store("coco", endpoint=endpoint, region="us-east-1", access_key_id="gpudetkey",
                    secret_access_key="gpudetsecret", client_options={"allow_http": True})
    with ThreadPoolExecutor(threads) as ex:
        return sum(ex.map(lambda k: len(obstore.get(store, k).bytes()), keys))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("endpoint", help="the server, e.g. http://127.0.0.1:9123")
    parser.add_argument("processes", type=int)
    parser.add_argument("threads", type=int, help="threads per process")
    parser.add_argument("objects", type=int, help="the first N objects of the set")
    args = parser.parse_args()
    endpoint, procs, threads, n = args.endpoint, args.processes, args.threads, args.objects
    keys = sorted(k for k in os.listdir("/tmp/gpudet-images/coco") if k.endswith(".jpg"))[:n]
    t0 = time.perf_counter()
    with get_context("spawn").Pool(procs) as pool:
        total = sum(pool.map(work, [(endpoint, keys[i::procs], threads) for i in range(procs)]))
    dt = time.perf_counter() - t0
    print(f"{procs} processes x {threads} threads: {len(keys) / dt:.0f} objects/s, {total / dt / 1e6:.0f} MB/s",
          flush=True)
