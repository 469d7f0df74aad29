"""`flexsarathi serve`: OpenAI's Files and Batches API in front of one engine (FastAPI on uvicorn).

The server is a front door like the command line: it owns the uploaded files and the batch records
on disk (store.py) and hands each batch to the result-file machinery `flexsarathi generate` uses
(batch_job.py), on a background thread that runs the batches one after another (runner.py); the
HTTP side (app.py, routes.py) only reads and writes those records and never waits on a pass.
"""
