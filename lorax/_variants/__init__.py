"""LoRA variants: DoRA, initialisations, LoRA dropout, LoRA+ (each in its cheap form)."""
