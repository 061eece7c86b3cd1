"""The model families of ``sparse_mla.integration.transformers`` (the entry: ``apply`` / ``undo``), one module each:
``dsa`` (DeepseekV32, GlmMoeDsa), ``glm5_next`` (Glm5Next, the NoPE layout), ``deepseek_v4`` (DeepseekV4), and
``common`` (checks, the latent attention, top-k to indices). transformers is never imported here."""
