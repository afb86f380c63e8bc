"""The vLLM suite: stock vLLM against rlkv's head mask on vLLM (`rlkv.vllm_plugin`), side by side."""
