from nccl_ddp.launch.cli import main

main()
