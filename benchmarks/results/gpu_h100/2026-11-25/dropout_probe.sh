export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
mkdir -p ../shared && tar -xJf .gpu/data.tar.xz -C ../shared
run() { python3 test_nlp_dgpipe.py --task rte --data-dir ../shared/data/glue --model-config tiny-roberta --max-length 64 --chunk 4 --batch-size 16 --train-subset 64 --eval-subset 64 --epochs 1 --lr 1e-4 --seed 3 --no-progress --timeout 60 --codec quant --codec-opt bits=8 "$@" 2>&1 | grep "^epoch" | sed "s/^/$* : /"; }
for s in 1 2 4; do for d in cpu,cpu cpu,cuda:0 cuda:0,cuda:0; do run --devices $d --max-steps $s; done; done
for d in cpu,cpu cuda:0,cuda:0; do run --devices $d --max-steps 4 --lr 0; done
python3 test_nlp_dgpipe.py --task sst2 --data-dir ../shared/data/glue --model $PWD/.gpu/minilm --train-subset 1280 --eval-subset 256 --batch-size 32 --chunk 4 --max-length 64 --epochs 1 --max-steps 15 --no-progress --timeout 120 --devices cuda:0,cuda:0 --mode dataparallel --log $OUT/nlp_ddp.jsonl 2>&1 | grep -E "^epoch|throughput"
