# One-off probe driver on the GPU machine (kept in git history for its command): bash probes/gpu_loop/run.sh face|net
set -u
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
IMAGES=/tmp/gpudet-images
R=$OUT/p; mkdir -p $R; export OUT=$R
if [ ! -f $IMAGES/jpg.txt ]; then
  python3 scripts/make_image_set.py $IMAGES --count 4000 > /dev/null
  grep -v png $IMAGES/list.txt | sed "s#^#$IMAGES/#" > $IMAGES/jpg.txt
fi
q() { grep -v -i "deprecat\|_handle_op\|libpng\|jpeg_parser\|libjpeg\|Corrupt JPEG\|TracerWarning\|warnings.warn"; }
for step in ${STEPS:-}; do
  case $step in
    imports)
      for i in 1 2 3; do /usr/bin/time -f "import wall %e s" python3 -X importtime -c "import pipeline.cli, pipeline.detector" 2> $R/importtime_$i.txt; tail -1 $R/importtime_$i.txt; done ;;
    face_default) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --setup-profile --gpu-profile --ort-alone 2>&1 | q ;;
    face_heuristic) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --cudnn-search HEURISTIC --ort-alone 2>&1 | q ;;
    face_prio) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --priority -5 --gpu-profile --ort-alone 2>&1 | q ;;
    face_nofuse) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --set run.fuse_conv_bias=false --ort-alone 2>&1 | q ;;
    face_nograph) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --set run.cuda_graph=false --ort-alone 2>&1 | q ;;
    face_again) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --ort-alone 2>&1 | q ;;
    face_rgb) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --set preprocess.channel_order=RGB --ort-alone 2>&1 | q ;;
    face_hw1) python3 probes/gpu_loop/gpu_probe.py $IMAGES/jpg.txt --tag $step --set preprocess.hw_decoder_load=1.0 2>&1 | q ;;
    rn_bench) python3 scripts/bench_retinanet.py $IMAGES/jpg.txt --out /tmp/gpudet-rn --limit 2000 --detections-per-image 100 --only gpudet 2>&1 | q; cp /tmp/gpudet-rn/bench_retinanet.json $R/ ;;
    alltests) JOBS=4 OUT=$R timeout ${TEST_LIMIT:-330} bash scripts/gpu_check.sh tests; tail -5 $R/pytest.log ;;
    amax) python3 probes/gpu_loop/amax.py 2>&1 | q ;;
    tests) TESTS="${TESTS:-tests/test_nms.py tests/test_postprocess.py tests/test_detector.py tests/test_engine.py tests/test_retinanet.py}" JOBS=4 OUT=$R bash scripts/gpu_check.sh tests ;;
    export_link) mkdir -p /tmp/rn && ln -sf /tmp/gpudet-rn/retinanet_heads_fp16_load_16_800x800_*.onnx /tmp/rn/rn_load.onnx && head -2000 $IMAGES/jpg.txt > /tmp/rn/rn2000.txt ;;
    export) [ -f /tmp/rn/rn_load.onnx ] || python3 probes/gpu_loop/export_rn.py $IMAGES/jpg.txt /tmp/rn 2>&1 | q ;;
    net_*)
      N="python3 probes/gpu_loop/gpu_probe.py /tmp/rn/rn2000.txt --config configs/retinanet_r50_coco.yaml --set model.path=/tmp/rn/rn_load.onnx --limit 2000"
      case $step in
        net_default) $N --tag $step --setup-profile --gpu-profile --ort-alone 2>&1 | q ;;
        net_prio) $N --tag $step --priority -5 --gpu-profile --ort-alone 2>&1 | q ;;
        net_again) $N --tag $step --ort-alone 2>&1 | q ;;
        net_nofuse) $N --tag $step --set run.fuse_conv_bias=false --ort-alone 2>&1 | q ;;
        net_heuristic) $N --tag $step --cudnn-search HEURISTIC --ort-alone 2>&1 | q ;;
      esac ;;
  esac
done
cd $R/.. && tar czf p_${TAG:-x}.tgz p && rm -rf p
