// The contract checks (contract.hpp) on the reference kernel. Rust twin:
// rust/tests/reference_kernel.rs.
#include <cstdio>

#include "contract.hpp"
#include "twinattn/reference_kernel.hpp"

int main() {
    contract::run_contract_tests("reference", twinattn::attention_reference);
    std::printf("%d failure(s)\n", twinattn_test::failures);
    return twinattn_test::failures == 0 ? 0 : 1;
}
