"""Setup phases of Detector.from_config in a fresh process: python phases.py CONFIG|- [--set k=v ...]"""
import json, sys, threading, time
t0 = time.perf_counter()
import torch  # noqa
t_torch = time.perf_counter()
from pipeline import detector as D, engine as E, preprocess as P, kernels as K
t_imp = time.perf_counter()
marks, lock = {}, threading.Lock()
base = [0.0]
def wrap(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        s = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            with lock:
                marks.setdefault(label, []).append((round(s - base[0], 3), round(time.perf_counter() - base[0], 3)))
    setattr(owner, name, w)
wrap(E.Engine, '__init__', 'session')
wrap(P.Preprocessor, '__init__', 'dali')
wrap(E.Engine, 'warm_up', 'engine_warm_up')
wrap(D.Detector, '_warm_up_postprocess', 'postprocess_warm_up')
if hasattr(K, 'compile_ahead'):
    for kern in (K._row_max_kernel, K._suppressor_words_kernel):
        wrap(kern, 'warmup', 'compile_ahead')
args = sys.argv[1:]
config = None if args[0] == '-' else args[0]
sets = [a for a in args[1:] if a != '--set']
base[0] = time.perf_counter()
det = D.Detector.from_config(config, device=__import__('os').environ.get('DEV', 'cuda'), overrides=sets)
t2 = time.perf_counter()
print(json.dumps({"torch_import": round(t_torch - t0, 3), "pipeline_import": round(t_imp - t_torch, 3),
                  "from_config": round(t2 - base[0], 3), "phases": marks, "triton": getattr(K.triton, '__version__', None)}))
