"""Process groups and collectives: `api` (the functional API, re-exported by `nccl_ddp`),
`group` (ProcessGroup, Work), and the `host` and `nccl` backends."""
