"""``lora-pin demo``: a tiny Llama-style model, a dozen PEFT adapters and a mixed workload, end to end."""
