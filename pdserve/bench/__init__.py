"""`pdserve bench`: a streaming load generator for any OpenAI-compatible server.

config    what to run (frozen dataclasses)     dataset   which requests (random, ShareGPT, ...)
arrival   when each request starts             runner    drives the workloads, warm-up, progress
client    one streamed request                 stream    SSE lines -> token timings and counts
record    one request's outcome                metrics   records -> summary (percentiles, goodput)
report    text table and the JSON file         plot      latency CDFs and throughput over time
stub      an instant fake server (tests, overhead)   cli  `pdserve bench`
"""
