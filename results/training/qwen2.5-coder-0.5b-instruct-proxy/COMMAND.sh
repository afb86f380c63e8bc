cd "$(git rev-parse --show-toplevel)"
OMP_NUM_THREADS=2 .venv/bin/rlkv mask-nll --solutions-from recipes/eval/qwen2.5-coder-0.5b-instruct.yaml --num 48 \
  --batch-size 8 --sparsities 0.75 --decisive 1.0 --random 3 \
  --masks ablation=results/masks/qwen2.5-coder-0.5b-instruct-ablation,grpo=results/masks/qwen2.5-coder-0.5b-instruct,dagger=results/training/qwen2.5-coder-0.5b-instruct-distill-hard-dagger,dagger2=results/training/qwen2.5-coder-0.5b-instruct-distill-hard-dagger2,hard=results/training/qwen2.5-coder-0.5b-instruct-distill-hard,mixed=results/training/qwen2.5-coder-0.5b-instruct-distill-mixed,top0.1=results/training/qwen2.5-coder-0.5b-instruct-distill-onpolicy-top0.1,onpolicy=results/training/qwen2.5-coder-0.5b-instruct-distill-onpolicy,distill=results/training/qwen2.5-coder-0.5b-instruct-distill \
  --pass-at-1 ablation@0.75=results/eval/qwen2.5-coder-0.5b-instruct:ablation-mask@0.75 --pass-at-1 grpo@0.75=results/eval/qwen2.5-coder-0.5b-instruct:rlkv@0.75 \
  --pass-at-1 random-mask@0@0.75=results/eval/qwen2.5-coder-0.5b-instruct:random-mask@0@0.75 --pass-at-1 random-mask@1@0.75=results/eval/qwen2.5-coder-0.5b-instruct:random-mask@1@0.75 --pass-at-1 random-mask@2@0.75=results/eval/qwen2.5-coder-0.5b-instruct:random-mask@2@0.75 \
  --pass-at-1 dagger@0.75=results/eval/qwen2.5-coder-0.5b-instruct-distill-hard-dagger:rlkv@0.75 --pass-at-1 dagger2@0.75=results/eval/qwen2.5-coder-0.5b-instruct-distill-hard-dagger2:rlkv@0.75 \
  --pass-at-1 hard@0.75=results/eval/qwen2.5-coder-0.5b-instruct-distill-hard:rlkv@0.75 --pass-at-1 mixed@0.75=results/eval/qwen2.5-coder-0.5b-instruct-distill-mixed:rlkv@0.75 \
  --pass-at-1 top0.1@0.75=results/eval/qwen2.5-coder-0.5b-instruct-distill-onpolicy-top0.1:rlkv@0.75 --pass-at-1 onpolicy@0.75=results/eval/qwen2.5-coder-0.5b-instruct-distill-onpolicy:rlkv@0.75 \
  --pass-at-1 distill@0.75=results/eval/qwen2.5-coder-0.5b-instruct-distill:rlkv@0.75 \
  --out results/training/qwen2.5-coder-0.5b-instruct-proxy/screen_s0.75_math48.json --no-progress
