// slidedpctl: see slidedpctl/ctl.h for the commands and exit codes.
#include <iostream>
#include <string>
#include <vector>

#include "slidedpctl/ctl.h"

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  return slidedp::ctl::RunCtl(args, std::cout, std::cerr);
}
