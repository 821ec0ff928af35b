# probe driver on the GPU machine: STEPS="..." bash probe_pp/run.sh
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
IMAGES=/tmp/gpudet-images
R=$OUT/p; mkdir -p $R; export OUT=$R
q() { grep -v -i "deprecat\|_handle_op\|libpng\|jpeg_parser\|libjpeg\|Corrupt JPEG\|TracerWarning\|warnings.warn"; }
for step in ${STEPS:-}; do
  echo "=== $step $(date +%T)"
  case $step in
    images) if [ ! -f $IMAGES/jpg.txt ]; then
        python3 scripts/make_image_set.py $IMAGES --count 4000 > /dev/null
        grep -v png $IMAGES/list.txt | sed "s#^#$IMAGES/#" > $IMAGES/jpg.txt
      fi ;;
    k) timeout 240 python3 probe_pp/bench_k.py 2>&1 | q | tail -40 ;;
    retinaface) RUNS="now:retinaface_mnet025" OUT=$R timeout 300 bash scripts/gpu_check.sh retinaface 2>&1 | tail -12 ;;
    ray) RAY_RUNS="${RAY_RUNS:-one;ray --ray --workers 1;one2;ray2 --ray --workers 1;one3;ray3 --ray --workers 1}" OUT=$R timeout 450 bash scripts/gpu_check.sh ray 2>&1 | grep -i "img/s\|images\|error" | tail -20 ;;
    pp) timeout ${PP_LIMIT:-300} python3 probe_pp/bench_pp.py 2>&1 | q | tail -40 ;;
    rn_bench) python3 scripts/bench_retinanet.py $IMAGES/jpg.txt --out /tmp/gpudet-rn --limit 2000 --detections-per-image 100 --only gpudet 2>&1 | q | tail -30; cp /tmp/gpudet-rn/bench_retinanet.json $R/bench_retinanet_${TAG:-x}.json ;;
    link) mkdir -p /tmp/rn && ln -sf /tmp/gpudet-rn/retinanet_heads_fp16_load_16_800x800_*.onnx /tmp/rn/rn_load.onnx && head -2000 $IMAGES/jpg.txt > /tmp/rn/rn2000.txt; ls -la /tmp/rn ;;
    tests) TESTS="${TESTS:-tests/test_nms.py tests/test_postprocess.py tests/test_detector.py tests/test_engine.py tests/test_retinanet.py}" JOBS=4 OUT=$R timeout ${TEST_LIMIT:-400} bash scripts/gpu_check.sh tests; tail -5 $R/pytest.log ;;
    net_*)
      N="python3 probe_pp/gpu_probe.py /tmp/rn/rn2000.txt --config configs/retinanet_r50_coco.yaml --set model.path=/tmp/rn/rn_load.onnx --limit 2000"
      case $step in
        net_profile) $N --tag $step --gpu-profile --ort-alone 2>&1 | q | tail -8 ;;
        net_again) $N --tag $step --ort-alone 2>&1 | q | tail -4 ;;
        net_compile) $N --tag $step --set postprocess.compile=true --ort-alone 2>&1 | q | tail -6 ;;
      esac ;;
  esac
done
cd $R/.. && tar czf p_${TAG:-x}.tgz p && rm -rf p
