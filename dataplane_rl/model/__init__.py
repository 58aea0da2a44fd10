"""The policy model, shared by the rollout actors and the train workers: built or loaded, its tokenizer, its log-probs."""
