import horovod_stand_in

horovod_stand_in.install()
