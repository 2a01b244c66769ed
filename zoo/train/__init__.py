"""Training, one concern a module:

    loop     the loop every recipe shares (device, DataLoader, AdamW with warmup and cosine decay,
             bf16 autocast, logging, periodic check, time budget, training.json) and `Recipe`,
             the contract a recipe fills in
    config   the settings as dataclasses, checked before anything trains (graph.spec.ConfigError)
    toy      the toy-zoo recipe: a zoo model on the toy world, its losses and its check
    data     the toy recipe's examples and batches
    labels   its training-only targets
    losses   its loss terms, as pure functions
    sparrow  Sparrow's draft head on a target's hidden states (models.sparrow)
    recipes  which recipe a `train:` block runs, and its key check

    python -m run +experiment=train_toy train.model=qwen-target      # zoo.train.toy.train
    python -m run +experiment=train_sparrow model=toy_qwen           # zoo.train.sparrow.train
"""
