module webhook-gateway/loadtests/gobackend

go 1.24
