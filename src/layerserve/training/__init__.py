"""Training: the text-classifier recipe, datasets, the tokenizer, jobs, their records and the job process."""
