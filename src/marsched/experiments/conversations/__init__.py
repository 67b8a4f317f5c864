"""Multi-turn tool-calling conversations under KV pressure: stock vLLM vs MARS retention vs fixed-time
retention (`scripts/conversation_bench.py`). `load`: the conversations; `client`: the turns as sent
and timed; `servers`: the three configurations' servers; `report`: the summary and the table;
`run`: one configuration after another."""
