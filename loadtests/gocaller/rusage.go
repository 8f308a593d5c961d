package main

import "syscall"

type syscallRusage struct{ user, sys float64 }

func getrusage(out *syscallRusage) {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		out.user = float64(ru.Utime.Sec) + float64(ru.Utime.Usec)/1e6
		out.sys = float64(ru.Stime.Sec) + float64(ru.Stime.Usec)/1e6
	}
}
