module webhook-gateway/loadtests/gocaller

go 1.19
