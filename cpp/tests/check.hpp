// A tiny test harness: CHECK records a failure and carries on; main returns failures != 0.
#pragma once

#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>

namespace twinattn_test {
inline int failures = 0;
}  // namespace twinattn_test

#define CHECK(condition)                                                                   \
    do {                                                                                   \
        if (!(condition)) {                                                                \
            std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #condition); \
            ++twinattn_test::failures;                                                     \
        }                                                                                  \
    } while (0)

// |actual - expected| <= tolerance, printing both values on failure.
#define CHECK_NEAR(actual, expected, tolerance)                                            \
    do {                                                                                   \
        const double check_actual_ = (actual), check_expected_ = (expected);               \
        if (!(std::fabs(check_actual_ - check_expected_) <= (tolerance))) {                \
            std::fprintf(stderr, "%s:%d: CHECK_NEAR failed: %s = %.9g, expected %.9g +- %g\n", \
                         __FILE__, __LINE__, #actual, check_actual_, check_expected_,      \
                         static_cast<double>(tolerance));                                  \
            ++twinattn_test::failures;                                                     \
        }                                                                                  \
    } while (0)

// expression throws ExceptionType whose what() contains message_part.
#define CHECK_THROWS(ExceptionType, expression, message_part)                              \
    do {                                                                                   \
        try {                                                                              \
            expression;                                                                    \
            std::fprintf(stderr, "%s:%d: CHECK_THROWS failed: %s did not throw\n", __FILE__, \
                         __LINE__, #expression);                                           \
            ++twinattn_test::failures;                                                     \
        } catch (const ExceptionType& check_error_) {                                      \
            if (std::strstr(check_error_.what(), (message_part)) == nullptr) {             \
                std::fprintf(stderr, "%s:%d: CHECK_THROWS: message \"%s\" lacks \"%s\"\n", \
                             __FILE__, __LINE__, check_error_.what(), (message_part));     \
                ++twinattn_test::failures;                                                 \
            }                                                                              \
        }                                                                                  \
    } while (0)
