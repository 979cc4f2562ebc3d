from nccl_ddp.launch.launcher import main

main()
