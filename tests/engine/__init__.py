"""Engine core: scheduler, paged cache, chains and tiers, models and loader, decode windows, tensor parallel."""
