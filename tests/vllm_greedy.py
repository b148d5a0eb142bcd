"""`python -m tests.vllm_greedy HF_DIR PROMPT_IDS_JSON MAX_TOKENS`: greedy completions of token-id
prompts by vLLM (fp32, in-process engine, small KV cache) loading `HF_DIR` with its own
tokenizer, printed as one JSON line. A separate process, so the engine's memory and threads go
away with it."""

from __future__ import annotations

import json
import os
import sys


def main(hf_dir: str, prompts_json: str, max_tokens: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=hf_dir,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
        max_model_len=512,
        enable_chunked_prefill=False,
        disable_log_stats=True,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), detokenize=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(prompts_json)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text} for o in outs]
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
