"""The paper's baselines (Orca-style contiguous reservations, FasterTransformer-style
request-level batching), for the evaluation only: ``kv_allocation`` other than "paged".

They stand behind the BlockManager's interface so a run swaps the memory manager and keeps
the rest. ``core.block_manager.create_block_manager`` imports this package only when a run
asks for a baseline, so the engine's core never loads the laboratory.
"""
