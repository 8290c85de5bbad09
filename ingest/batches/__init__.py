"""Files and batch jobs (OpenAI Batches, Anthropic Message Batches): routes, records and the dispatcher every API node runs."""
